"""Plumbing every part uses: artifact storage (fsspec), local files written whole, processes and ports, secrets, ladle's home, the Prefect API and processes' start-up."""
