"""Training: offline data preparation (`data`, `chat_template`, `bfcl`) and the block-diffusion trainer."""
