"""Tasks: where a stage's data, problems, held-out evals and gold judges come from."""
