"""Workers, one class per role: Policy (actor.py), Reference (reference.py), Critic (critic.py)."""
