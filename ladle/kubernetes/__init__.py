"""Kubernetes, shared by training and serving: ``kubectl`` with deadlines and the state of jobs, pods and Kueue read from it (``status``)."""
