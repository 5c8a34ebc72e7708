"""The one-command 3D-parallel training demo: ``python -m overlap.train`` (see __main__)."""
