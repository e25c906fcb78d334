"""A trained model's life after training: merge, evaluate, the gate and the champion's registry (``promote``, ``registry``: the one MLflow client, ``lock``), tracking, lineage and events."""
