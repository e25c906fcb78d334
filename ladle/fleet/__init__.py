"""The fleet that runs the inference server: the front that keeps one address (``front``), its supervisor, canaries, serving the champion, the deploy stage and Kubernetes serving."""
