"""Checkpoints and what they are read with: the seeded factory and its presets, the trained
presets, chat templates, prompt encoding, the served identity, the factory's corpus."""
