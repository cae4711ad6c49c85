"""Optimizer presets: learning-rate laws fitted for a run, declared once and reused by its twins
and sweeps."""

from keel.spec import LrScalingLaw

hero_lr_law = LrScalingLaw(coefficient=0.087571, tokens_exponent=-0.3461, width_exponent=-0.3448, muon_to_adam=13 / 3)
"""The hero run's law: adam_lr = 0.087571 x T^-0.3461 x D^-0.3448 x sqrt(tokens per step), MuonH 13/3 of it."""
