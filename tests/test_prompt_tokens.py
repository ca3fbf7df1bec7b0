"""Text prompts are tokenized as the checkpoint's tokenizer does by default (`tokenizer(text)`: a Llama BOS
kept, as vLLM keeps it), for three kinds of tokenizer saved beside tiny random checkpoints: byte-level BPE
without a BOS (Qwen, the embedded model), Llama-style with a BOS post-processor, and SentencePiece-style with
byte fallback. The prompt ids equal `tokenizer(text).input_ids` and greedy output equals transformers'."""

from __future__ import annotations

import pytest
import torch

import minirt
from conftest import VOCAB, build_tiny_checkpoint, hf_model

CORPUS = ["ROMEO. But soft, what light through yonder window breaks?", "JULIET. O Romeo, Romeo, wherefore art thou",
          "Of Man's first disobedience, and the fruit of that forbidden tree", "To be, or not to be: that is the"]
TEXTS = ["ROMEO. But soft", "Of Man's first fruit, é and ✓"]      # the last characters: byte fallback or bytes
N = 8


def _tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "sentencepiece":      # Llama-2 style: Metaspace pieces, unknown characters as <0xNN> byte tokens
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special))
    else:                            # byte-level BPE (GPT-2, Qwen, Llama 3)
        special = ["<s>", "</s>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind != "bpe":                # a BOS added by the post-processor, as Llama's tokenizers do
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    assert tok.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>" if kind == "sentencepiece" else None)


@pytest.fixture(scope="module", params=["bpe", "llama", "sentencepiece"])
def checkpoint(request, tmp_path_factory):
    path = build_tiny_checkpoint("llama" if request.param != "bpe" else "qwen3",
                                 tmp_path_factory.mktemp(f"prompt_tokens_{request.param}"), seed=3)
    tokenizer = _tokenizer(request.param)
    tokenizer.save_pretrained(path)
    return request.param, str(path)


def test_text_prompts_tokenized_by_the_tokenizers_defaults(checkpoint):
    from transformers import AutoTokenizer

    kind, path = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = minirt.LLM(path, dtype="float32", device="cpu", block_size=4)
    outs = llm.generate(TEXTS, minirt.SamplingParams(max_new_tokens=N, ignore_eos=True))
    model = hf_model(path)
    for text, out in zip(TEXTS, outs):
        expected = tokenizer(text).input_ids
        assert (expected[0] == tokenizer.bos_token_id) == (kind != "bpe"), "the BOS rule of this tokenizer"
        if kind == "sentencepiece":
            assert any(t.startswith("<0x") for t in tokenizer.convert_ids_to_tokens(expected)) == ("é" in text)
        assert out.prompt_token_ids == expected
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            ref = model.generate(**enc, do_sample=False, max_new_tokens=N, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, enc.input_ids.shape[1]:].tolist()
