"""Workers, one class per role: Policy (policy.py), Reference (reference.py), Critic (critic.py)."""
