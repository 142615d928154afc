"""posttrain: LLM post-training from one YAML recipe, measured on the roofline."""

__version__ = "0.1.0"
