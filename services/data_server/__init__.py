"""data-server: GSM8K, MATH-style, QA and synthetic prompts as verl rows, in seeded resumable batches."""
