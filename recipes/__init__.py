"""The shipped recipes (``*.yaml``) and model configs (``models/NAME/config.json``): package data of ``ladle.recipes``."""
