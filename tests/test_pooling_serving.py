"""Pooling requests over the wire: the clients' embed() and score() (sync and async) against a real core, the
HTTP endpoints with the official `openai` SDK's embeddings.create (float and base64) and plain /v1/rerank
and /v1/score calls, each against transformers; Qwen's prompts token for token as the model cards build
them; bad input as a 400 naming the field with the core serving on; and an embedding model's core, which
refuses generation and scores by name.
"""
from __future__ import annotations

import asyncio
import base64
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

sys.path.insert(0, os.path.dirname(__file__))
from helpers.daemon import ENV  # noqa: E402
from helpers.http import sdk, start_serve, stop, wait_healthy  # noqa: E402
from helpers.pooling import hf_embeddings, hf_label_logits, make_embedding_model, make_reranker_model  # noqa: E402
from llmserve_client import AsyncClient, Client, RequestError, run  # noqa: E402
from llmserve_client import pooling  # noqa: E402
from llmserve_core.models.tiny import make_tiny_model  # noqa: E402
from llmserve_proto import Generate, Hello, Pool, PoolingParams, RequestError as WireError, encode  # noqa: E402

ENGINE = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "128", "--block-size", "16",
          "--log-interval", "0"]
CORE = [*ENGINE, "--heartbeat-interval", "0.2", "--client-timeout", "5"]
NAME = "rr"
DOCS = ["The capital of China is Beijing.", "Gravity is a force.", "Cats purr when content."]


def hf_hidden(model_dir, prompts):
    """A causal LM's final normed hidden state at each prompt's last position (transformers, float32)."""
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.nn.functional.normalize(model.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                for p in prompts]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """(model dir, its tokenizer, core endpoint, frontend base URL): a tiny causal LM whose vocabulary has
    "yes" and "no", served for generation (it scores and embeds too)."""
    tmp = tmp_path_factory.mktemp("rerank")
    model = make_reranker_model(make_tiny_model(tmp / "base", seed=3, vocab_size=1040), tmp / "model")
    endpoint = f"ipc://{tmp}/core.sock"
    core = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model, "--listen", endpoint, *CORE],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp / "core.log", "wb"))
    serve, base = start_serve(str(tmp / "serve.log"), "--endpoint", endpoint, "--served-model-name", NAME,
                              "--max-pooling-inputs", "8")
    try:
        wait_healthy(serve, base, str(tmp / "serve.log"), timeout=300)
        from transformers import AutoTokenizer
        yield model, AutoTokenizer.from_pretrained(model), endpoint, base
    finally:
        stop(serve)
        stop(core)


# ---------------------------------------------------------------- the prompts

def test_the_prompts_are_the_model_cards(reranker):
    """The reranker's prompt as Qwen3-Reranker's card builds it (prefix, the formatted pair, suffix, each
    tokenized alone), the embedding's as Qwen3-Embedding's tokenizer does (the text, then <|endoftext|>)."""
    _, tok, _, _ = reranker
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    task = "Given a web search query, retrieve relevant passages that answer the query"
    pair = f"<Instruct>: {task}\n<Query>: What is the capital of China?\n<Document>: {DOCS[0]}"
    card = (tok.encode(prefix, add_special_tokens=False) + tok(pair)["input_ids"]
            + tok.encode(suffix, add_special_tokens=False))
    assert pooling.rerank_prompts(tok, "What is the capital of China?", DOCS[:1]) == [card]
    query = pooling.embedding_prompt(tok, "Explain gravity", "Given a web search query, retrieve relevant passages")
    assert tok.decode(query) == ("Instruct: Given a web search query, retrieve relevant passages\nQuery:Explain gravity"
                                 "<|endoftext|>")
    assert pooling.embedding_prompt(tok, DOCS[1])[-1] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert pooling.yes_no_ids(tok) == [tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")]


# ---------------------------------------------------------------- the client library

def test_client_embed_and_score_equal_transformers(reranker):
    model, tok, endpoint, _ = reranker
    with Client(endpoint) as c:
        assert c.model_info.tasks == ["generate", "embed", "score"] and c.model_info.hidden_size == 64
        got = c.embed(DOCS[:2] + ["What is it?"], instruction=None)
        want = hf_hidden(model, [pooling.embedding_prompt(tok, t) for t in DOCS[:2] + ["What is it?"]])
        np.testing.assert_allclose(got.embeddings, [w.numpy() for w in want], atol=2e-6)
        assert got.usage.prompt_tokens == sum(len(pooling.embedding_prompt(tok, t)) for t in DOCS[:2] + ["What is it?"])
        short = c.embed("Explain gravity", instruction="Find passages", dimensions=8, normalize=False)
        ids = pooling.embedding_prompt(tok, "Explain gravity", "Find passages")
        from transformers import Qwen3ForCausalLM
        hf = Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with torch.no_grad():
            raw = hf.model(torch.tensor([ids])).last_hidden_state[0, -1, :8]
        np.testing.assert_allclose(short.embeddings[0], raw.numpy(), atol=2e-6)
        scores = c.score("What is the capital of China?", DOCS, instruction="Judge relevance")
        prompts = pooling.rerank_prompts(tok, "What is the capital of China?", DOCS, "Judge relevance")
        logits = hf_label_logits(model, prompts, pooling.yes_no_ids(tok))
        np.testing.assert_allclose(scores.logits, [y - n for y, n in logits], atol=1e-5)
        np.testing.assert_allclose(scores.scores, [sigmoid(y - n) for y, n in logits], atol=1e-6)
        # A pooling request and a generation beside it on one connection.
        assert c.generate("Hello", max_tokens=3, temperature=0, ignore_eos=True).usage.completion_tokens == 3


def test_async_client_embed_and_score(reranker):
    model, tok, endpoint, _ = reranker

    async def main():
        async with AsyncClient(endpoint) as c:
            e, s = await asyncio.gather(c.embed(DOCS), c.score("cats", DOCS))
            return e, s

    e, s = run(main())
    want = hf_hidden(model, [pooling.embedding_prompt(tok, t) for t in DOCS])
    np.testing.assert_allclose(e.embeddings, [w.numpy() for w in want], atol=2e-6)
    assert e.raw[0] == np.asarray(e.embeddings[0], dtype="<f4").tobytes()
    logits = hf_label_logits(model, pooling.rerank_prompts(tok, "cats", DOCS), pooling.yes_no_ids(tok))
    np.testing.assert_allclose(s.logits, [y - n for y, n in logits], atol=1e-5)


def test_client_errors_name_the_input(reranker):
    _, _, endpoint, _ = reranker
    with Client(endpoint) as c:
        for call, field in ((lambda: c.embed([]), "input"), (lambda: c.embed([1.5]), "input"),
                            (lambda: c.embed("x", dimensions=0), "dimensions"),
                            (lambda: c.embed("x", dimensions=10**30), "dimensions"),
                            (lambda: c.score("q", []), "documents"), (lambda: c.score(3, ["d"]), "query"),
                            (lambda: c.pool([[1, 2]], PoolingParams(task="score", token_ids=[5000])), "token_ids")):
            with pytest.raises(RequestError) as e:
                call()
            assert e.value.field == field
        with pytest.raises(RequestError) as e:
            c.embed(["fine", "x " * 400])           # the second is over the context
        assert e.value.field == "prompt_token_ids" and e.value.index == 1
        assert len(c.embed("still serving").embeddings) == 1


# ---------------------------------------------------------------- HTTP

def test_openai_sdk_embeddings_float_and_base64(reranker):
    model, tok, _, base = reranker
    client = sdk(base)
    want = [w.numpy() for w in hf_hidden(model, [pooling.embedding_prompt(tok, t) for t in DOCS])]
    floats = client.embeddings.create(model=NAME, input=DOCS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == NAME
    np.testing.assert_allclose([d.embedding for d in floats.data], want, atol=2e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(
        len(pooling.embedding_prompt(tok, t)) for t in DOCS)
    # The SDK asks for base64 and decodes it (this time from the prefix cache: float32 rounding apart).
    default = client.embeddings.create(model=NAME, input=DOCS)
    np.testing.assert_allclose([d.embedding for d in default.data], want, atol=2e-6)
    assert all(np.float32(x) == x for d in floats.data for x in d.embedding)     # float32 values, exactly
    raw = client.embeddings.create(model=NAME, input=DOCS[0], encoding_format="base64", dimensions=16)
    values = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert values.shape == (16,) and abs(np.linalg.norm(values) - 1) < 1e-5
    ids = client.embeddings.create(model=NAME, input=[[5, 6, 7], [8, 9]], encoding_format="float")
    want = [w.numpy() for w in hf_hidden(model, [[5, 6, 7], [8, 9]])]
    np.testing.assert_allclose([d.embedding for d in ids.data], want, atol=2e-6)


def test_rerank_and_score_over_plain_http(reranker):
    model, tok, _, base = reranker
    query = "What is the capital of China?"
    logits = hf_label_logits(model, pooling.rerank_prompts(tok, query, DOCS), pooling.yes_no_ids(tok))
    want = [sigmoid(y - n) for y, n in logits]
    r = httpx.post(base + "/v1/rerank", json={"model": NAME, "query": query, "documents": DOCS, "top_n": 2},
                   timeout=120).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in r["results"]] == order
    assert [x["document"]["text"] for x in r["results"]] == [DOCS[i] for i in order]
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [want[i] for i in order], atol=1e-6)
    assert r["usage"]["total_tokens"] == sum(len(p) for p in pooling.rerank_prompts(tok, query, DOCS))
    bare = httpx.post(base + "/v1/rerank", json={"query": query, "documents": [{"text": d} for d in DOCS],
                                                 "return_documents": False, "use_activation": False}).json()
    assert all("document" not in x for x in bare["results"]) and len(bare["results"]) == 3
    np.testing.assert_allclose(sorted(x["relevance_score"] for x in bare["results"]),
                               sorted(y - n for y, n in logits), atol=1e-5)
    s = httpx.post(base + "/v1/score", json={"model": NAME, "text_1": query, "text_2": DOCS}).json()
    assert s["object"] == "list" and [d["index"] for d in s["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in s["data"]], want, atol=1e-6)
    pairs = httpx.post(base + "/v1/score", json={"text_1": [query, "cats"], "text_2": DOCS[:2]}).json()
    second = hf_label_logits(model, pooling.rerank_prompts(tok, "cats", DOCS[1:2]), pooling.yes_no_ids(tok))[0]
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [want[0], sigmoid(second[0] - second[1])],
                               atol=1e-6)


BAD = [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [""]}, "input"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input[1]"),
    ("/v1/embeddings", {"input": ["a"] * 9}, "input"),
    ("/v1/embeddings", {"input": "x " * 400}, "input"),
    ("/v1/embeddings", {"input": "x" * 100_000}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], [2**63]]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2], [5000]]}, "input[1]"),
    ("/v1/embeddings", {"input": [[-1]]}, "input"),
    ("/v1/embeddings", {"input": [1.5]}, "input"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 2**64}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": -2**63}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 1e300}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": "8"}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "model": "other"}, "model"),
    ("/v1/embeddings", {"model": NAME}, "input"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 9}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d", 3]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d", "x " * 400]}, "documents[1]"),
    ("/v1/rerank", {"query": 7, "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 1e300}, "top_n"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": None, "text_2": ["c"]}, "text_1"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(reranker, path, body, param):
    _, _, _, base = reranker
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_non_json_numbers_and_bodies_are_refused_and_the_core_serves_on(reranker):
    _, _, _, base = reranker
    for raw in (b'{"input": [NaN]}', b'{"input": "a", "dimensions": Infinity}', b'[1]', b'{"input":'):
        r = httpx.post(base + "/v1/embeddings", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert len(sdk(base).embeddings.create(model=NAME, input="fine").data) == 1


# ---------------------------------------------------------------- an embedding model's core

@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """An llmserve-serve that owns a core on a tiny Qwen3Model checkpoint (the pooling runner)."""
    tmp = tmp_path_factory.mktemp("embedder")
    model = make_embedding_model(tmp / "model", seed=4)
    serve, base = start_serve(str(tmp / "serve.log"), "--model", model, "--served-model-name", "emb", *ENGINE)
    try:
        wait_healthy(serve, base, str(tmp / "serve.log"), timeout=300)
        yield model, base
    finally:
        stop(serve)


def test_an_embedding_models_frontend_embeds_and_refuses_the_rest(embedder):
    model, base = embedder
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    got = sdk(base).embeddings.create(model="emb", input=DOCS, encoding_format="float")
    want = hf_embeddings(model, [pooling.embedding_prompt(tok, t) for t in DOCS])
    np.testing.assert_allclose([d.embedding for d in got.data], [w.numpy() for w in want], atol=2e-6)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "q", "text_2": ["d"]})):
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "no lm_head" in httpx.post(base + "/v1/rerank", json={"query": "q", "documents": ["d"]}).text


def test_an_embedding_core_refuses_generation_on_the_wire(embedder, tmp_path):
    """Past the frontend's checks: the core itself answers a Generate (and a score) with a request_error
    naming `task`, and serves on."""
    import zmq
    from helpers.daemon import recv_reply
    model, _ = embedder
    endpoint = f"ipc://{tmp_path}/core.sock"
    core = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model, "--listen", endpoint, *CORE],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "core.log", "wb"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 180_000)      # a core that never answers fails the test, never hangs it
    try:
        sock.connect(endpoint)
        sock.send(encode(Hello(client_name="raw")))
        welcome = recv_reply(sock)
        assert welcome.model_info.runner == "pooling" and welcome.model_info.tasks == ["embed"]
        sock.send(encode(Generate(request_id="g", prompt_token_ids=[1, 2])))
        sock.send(encode(Pool(request_id="s", prompt_token_ids=[1, 2],
                              params=PoolingParams(task="score", token_ids=[3]))))
        sock.send(encode(Pool(request_id="e", prompt_token_ids=[1, 2])))
        replies = {}
        while len(replies) < 3:
            msg = recv_reply(sock)
            for item in (msg.outputs if hasattr(msg, "outputs") else [msg]):
                replies[item.request_id] = item
        assert isinstance(replies["g"], WireError) and replies["g"].field == "task"
        assert isinstance(replies["s"], WireError) and replies["s"].field == "task"
        assert len(np.frombuffer(replies["e"].embedding, dtype="<f4")) == 64
    finally:
        sock.close()
        ctx.term()
        core.terminate()
        core.wait(60)


# ---------------------------------------------------------------- llmserve-bench embed

def test_bench_embed_smoke(reranker, tmp_path):
    _, _, endpoint, _ = reranker
    out = tmp_path / "embed.json"
    r = subprocess.run([sys.executable, "-m", "llmserve_bench", "embed", "--endpoint", endpoint, "--lengths", "8,24",
                        "--batch-sizes", "1,4", "--num-documents", "8", "--concurrency", "2", "--seed", "5",
                        "--result-json", str(out), "--no-progress"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Embedding / Rerank Benchmark Result" in r.stdout
    import json
    data = json.loads(out.read_text())
    points = data["points"]
    assert [(p["task"], p["length"], p["batch_size"]) for p in points] == [
        (t, n, b) for t in ("embed", "rerank") for n in (8, 24) for b in (1, 4)]
    assert all(p["documents"] == 8 and p["tokens"] == 8 * p["length"] and p["docs_per_s"] > 0 for p in points)
    assert all(p["cached_tokens"] == 0 for p in points)           # fresh random documents share no block
    assert data["model_info"]["tasks"] == ["generate", "embed", "score"]


@pytest.mark.parametrize("args, code, message", [
    (["--lengths", "0"], 2, "--lengths"),
    (["--tasks", "classify"], 2, "--tasks"),
    (["--lengths", "100000"], 1, "do not fit"),
])
def test_bench_embed_bad_arguments(reranker, args, code, message):
    _, _, endpoint, _ = reranker
    r = subprocess.run([sys.executable, "-m", "llmserve_bench", "embed", "--endpoint", endpoint, "--no-progress",
                        "--num-documents", "2", *args], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == code and message in r.stderr, r.stderr
