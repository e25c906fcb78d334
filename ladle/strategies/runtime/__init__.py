"""Worker-side helpers of the strategies that import torch: never imported while planning."""
