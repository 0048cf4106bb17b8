"""Version shims: every place that depends on a specific version of a dependency lives here."""

from __future__ import annotations


def gguf_tokenizer_from_fields(architecture: str, tokenizer_dict: dict, tokenizer_config: dict):
    """A transformers fast tokenizer from GGUF tokenizer metadata, without torch.

    transformers >= 5 converts GGUF vocabularies in ``integrations.gguf.convert_gguf_tokenizer``
    (torch-free), but its own GGUF *reader* imports torch; specjax reads the fields with the
    ``gguf`` package and hands them to the converter.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x kept it in integrations.ggml
        from transformers.integrations.ggml import convert_gguf_tokenizer
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    # the GGUF's own metadata wins over the converter's guesses: transformers 5.17's converter also returns
    # bos/eos/unk (SmolLM2's eos as <|im_start|>, where the GGUF says <|im_end|>), and both as keywords raise;
    # a token the GGUF does not name (None) leaves the converter's
    named = {k: v for k, v in tokenizer_config.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **named})

