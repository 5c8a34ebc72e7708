"""The one-command main job (tp x cp x pp x dp, ep for MoE): ``python -m overlap.train``
(see __main__)."""
