"""Names that reward and generate files written for THUDM's slime import (`slime.utils.types`)."""
