"""autoplan: an automatic parallelization planner for PyTorch."""
