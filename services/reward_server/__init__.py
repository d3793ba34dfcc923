"""reward-server: checks answers (gsm8k, math-verify, Search-R1 QA, a neural reward model) for RL rewards."""
