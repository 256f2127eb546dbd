"""A run's model written in formats others load: CTranslate2 and Hugging Face transformers (Marian)."""
