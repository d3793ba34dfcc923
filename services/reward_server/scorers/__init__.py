"""Pure scoring functions, one module per family: gsm8k, math (math-verify), qa (EM / F1), shaping, model."""
