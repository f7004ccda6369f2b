"""Text data for training and evaluation: documents and packed token streams (text.py), the BPE
tokenizer (tokenizer.py), WikiText and LAMBADA (eval_text.py) and where ``../shared/data`` is (shared.py)."""
