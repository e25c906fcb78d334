"""Agents trained the way they are served (``training.rl.environment``): environments whose methods are tools
(``environments``), a subprocess that runs them with a deadline and a cap on what they return (``host``), and
the multi-turn episodes that ladle's engine rolls out through the served chat template and tool parser
(``episodes``)."""
