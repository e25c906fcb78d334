"""Plumbing every part uses: artifact storage (fsspec), local files written whole, processes and ports, secrets, ladle's home and the Prefect API."""
