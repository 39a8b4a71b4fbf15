"""The target model: the decoder, its weights and their loading, the tokenizer."""
