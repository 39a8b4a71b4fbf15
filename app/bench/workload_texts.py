"""The load test's texts (`specserve loadtest`), which the bench's chat workload reuses (app.bench.workloads).

Everything here is written for this project (no benchmark data set) and deterministic for a seed, so every run
offers the same load:

* `SYSTEM_PROMPT`, a few hundred tokens every conversation shares (what a prefix cache can keep);
* `user_turns`: one user's messages, a conversation about one topic, each about 150 tokens, so that with an
  answer of about 128 tokens a turn adds about 300 tokens of conversation (issue 31's shape);
* `long_prompt`: a document sized to a token budget (near the server's max input), distinct per index so that
  long prompts share no prefix but their first words (`long_document`: one of a given number of sentences);
* `SHORT_PROMPTS`: one-line questions sent beside the long ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable

SYSTEM_PROMPT = """You are the assistant of specserve, a text-generation server that answers with speculative \
decoding: a small draft proposes several tokens, the target model checks them in one forward pass, and every \
token the target agrees with is kept, so the answers are exactly the target's own, only sooner. You help the \
engineers who run the server, and the people who write programs against it.

How you answer:
1. Answer the question that was asked first, in one or two sentences, then give the details that support it. \
Do not repeat the question back.
2. Be concrete. When a setting matters, name it as the server names it (for example max_concurrent_requests, \
max_queue_size, prefill_chunk_tokens or num_draft_tokens) and say what it changes and what it costs.
3. When you give a command or a request body, give one that works as written: the routes are \
/v1/chat/completions, /v1/completions, /generate and /generate_stream, and every request may stream.
4. Say plainly when you do not know, or when the answer depends on the machine: throughput on two CPU cores is \
not throughput on a GPU, and a measurement on a busy machine is not a measurement.
5. Keep earlier turns of the conversation in mind. If the user changes the question, answer the new one; if the \
user corrects you, say what was wrong and correct it.
6. Prefer short paragraphs and short lists. Use a table only when the user compares several options.
7. Never invent figures. If a figure would help, say how to measure it: which command, which flags, and what to \
read in the report (time to first token, the gaps between tokens, tokens per second, errors and refusals).

What you know about the server: requests wait in a bounded queue and are refused with 429 when it is full; the \
engine decodes every running request in one batch, one step at a time; long prompts are prefilled in chunks so \
that running streams keep receiving tokens; greedy answers are the same alone and in a batch; the metrics follow \
vLLM's names with the prefix specserve_. Answer in English unless the user writes in another language."""

# A conversation is about one topic; every turn asks about one aspect of it, in one of several phrasings.
_TOPICS = [
    ("speculative decoding", "a draft model proposes tokens and the target verifies them"),
    ("the key-value cache", "every layer keeps the keys and values of the tokens it has seen"),
    ("continuous batching", "requests join and leave the running batch between decoding steps"),
    ("chunked prefill", "a long prompt is processed a slice at a time beside the running streams"),
    ("admission control", "a bounded queue decides which request waits and which one is refused"),
    ("tokenization", "text becomes token ids through a learned vocabulary of pieces"),
    ("streaming responses", "each step's new text is sent to the client as a server-sent event"),
    ("quantized weights", "the weights are stored in fewer bits and widened when they are used"),
    ("Prometheus metrics", "counters and histograms describe what the server did"),
    ("sampling", "a temperature and top-p turn the model's scores into a random choice"),
    ("prefix caching", "requests that start with the same tokens reuse the cached work of the first one"),
    ("load testing", "many clients send requests at once while the latency of each is recorded"),
]
_ASPECTS = [
    "how it works step by step",
    "what it costs in memory",
    "what it costs in latency for the first token",
    "how it changes the tokens per second of a busy server",
    "which settings control it and what their defaults should be",
    "how it can fail and how the failure shows in the logs",
    "how to measure whether it helps on a machine with two CPU cores",
    "how it interacts with many users that share one long system prompt",
    "what a beginner usually gets wrong about it",
    "how it compares with what vLLM and text-generation-inference do",
    "how to explain it to a product manager in three sentences",
    "what to test before turning it on in production",
]
_OPENINGS = [
    "Thanks, that helps.",
    "Let me follow up on that.",
    "I am still thinking about your last answer.",
    "Good, now a related question.",
    "That is clearer now.",
    "I tried to apply this to our deployment.",
]
_CONTEXTS = [
    "We run the server on a small machine for an internal tool, with about {n} people using it during the day, "
    "most of them sending short questions, a few of them pasting whole documents.",
    "Our team is comparing serving options before we commit to one, and we have about {n} requests a minute at "
    "the busiest hour, with answers of a few hundred tokens each.",
    "I am writing the runbook for the people on call, and I want every paragraph to be correct, because they "
    "will read it at three in the morning when {n} users are waiting for an answer.",
    "A colleague measured the server last week and saw the first token arrive later when {n} conversations were "
    "open at once, and we would like to understand why before we change anything.",
]
_DETAILS = [
    "The machine has two CPU cores and no GPU, the model is the small default one, and the server runs with its "
    "default settings except for a larger queue, because refusing requests looked worse to us than waiting.",
    "Most of our prompts are between two hundred and a thousand tokens long, and the answers we ask for are "
    "usually a few paragraphs, although some users ask for a single word and expect it at once.",
    "We watch the time to first token and the gaps between tokens on a dashboard, and we would like both to stay "
    "steady when a colleague pastes a long document into the chat in the middle of the afternoon.",
    "Nobody on the team has run a serving stack before this one, so please do not assume we know the usual "
    "vocabulary, and say so when a term you use has a precise meaning that matters here.",
]
_ASKS = [
    "Could you explain {aspect} for {topic}? In short: {summary}; I would like the details.",
    "For {topic}, please tell me {aspect}. I understand the outline, that {summary}, but not more.",
    "What should I know about {aspect}, in the case of {topic}? My understanding is that {summary}.",
    "Walk me through {aspect} for {topic}, assuming I know only that {summary}.",
]
_CLOSINGS = [
    "Please keep the answer practical and name the settings involved.",
    "A short list of points would be ideal, with one example.",
    "If there is a trade-off, say which side you would choose for us and why.",
    "Please say what you are unsure about, too.",
]

# Questions a user sends beside the long prompts: short prompts, short answers.
SHORT_PROMPTS = [
    "Say hello in one word.",
    "Name three colours.",
    "What is the capital of Italy?",
    "Count from one to five.",
    "Give me a synonym for fast.",
    "Is water wet? Answer yes or no.",
]

# The long documents are status reports assembled from these parts (seeded), so that no two are the same.
_SUBJECTS = [
    "The scheduler",
    "The worker thread",
    "The draft model",
    "The target model",
    "The tokenizer",
    "The admission queue",
    "The metrics registry",
    "The streaming route",
    "The batch planner",
    "The prefill stage",
    "The detokenizer",
    "The health check",
]
# The agent workload names its failing tests with these verbs too (app.bench.workloads.tool_result).
VERBS = [
    "handled",
    "delayed",
    "measured",
    "reported",
    "rejected",
    "verified",
    "cached",
    "split",
    "merged",
    "streamed",
    "recorded",
    "prefilled",
]
_OBJECTS = [
    "{n} requests",
    "{n} tokens of context",
    "a batch of {n} rows",
    "{n} drafted tokens",
    "a prompt of {n} tokens",
    "{n} refusals",
    "{n} streamed events",
    "a queue of {n} waiting requests",
]
_WHENS = [
    "during the morning peak",
    "after the restart at {n}:00",
    "while the long prompts were prefilled",
    "before the cache was warm",
    "in the nightly load test",
    "when two users sent the same question",
    "in step {n} of the run",
    "beside a chunked prefill",
]


def user_turns(user: int, turns: int, seed: int = 0) -> list[str]:
    """The `turns` user messages of conversation `user`: one topic, a different aspect each turn, each about
    150 tokens; the same for the same (user, turns, seed), different across users."""
    rng = random.Random(seed * 1_000_003 + user)
    topic, summary = _TOPICS[(user + seed) % len(_TOPICS)]
    aspects = rng.sample(_ASPECTS, min(turns, len(_ASPECTS)))
    messages = []
    for t in range(turns):
        aspect = aspects[t % len(aspects)]
        parts = [] if t == 0 else [rng.choice(_OPENINGS)]
        parts.append(rng.choice(_CONTEXTS).format(n=rng.randint(3, 200)))
        parts.append(rng.choice(_DETAILS))
        parts.append(rng.choice(_ASKS).format(aspect=aspect, topic=topic, summary=summary))
        parts.append(rng.choice(_CLOSINGS))
        if t > 0:  # refer back, as a user in a conversation does: the earlier turns matter to the answer
            parts.append(f"This is question {t + 1} of our conversation; keep your earlier answers consistent.")
        messages.append(" ".join(parts))
    return messages


def sentence(rng: random.Random) -> str:
    """One sentence of an operations report, drawn from `rng` (the agent workload's search results use them too)."""
    n = rng.randint(2, 9000)
    return (
        f"{rng.choice(_SUBJECTS)} {rng.choice(VERBS)} {rng.choice(_OBJECTS).format(n=n)} "
        f"{rng.choice(_WHENS).format(n=rng.randint(0, 23))}."
    )


def long_document(index: int, sentences: int, seed: int = 0) -> str:
    """Report `index` of `sentences` seeded sentences, with a question at the end; distinct per index."""
    rng = random.Random(seed * 1_000_003 + 500_000 + index)
    body = " ".join(sentence(rng) for _ in range(sentences))
    return (
        f"Operations report number {index + 1}. {body}\n\n"
        "Read the report above and say in one sentence which component appears most often."
    )


def long_prompt(index: int, target_tokens: int, count_tokens: Callable[[str], int], seed: int = 0) -> str:
    """`long_document(index)` with as many sentences as fit in `target_tokens` as `count_tokens` counts them
    (the server's tokenizer, chat template included): a few counts, each scaling the length to the target."""
    sentences = max(1, target_tokens // 16)  # a sentence is about 16 tokens: a first guess
    best = 0  # the most sentences counted to fit
    for _ in range(6):
        n = count_tokens(long_document(index, sentences, seed))
        if n <= target_tokens:
            best = max(best, sentences)
            if n >= 0.97 * target_tokens:
                break
        # Aim a little under: the header and the question do not scale with the sentences.
        scaled = int(sentences * 0.99 * target_tokens / max(n, 1))
        sentences = max(1, min(scaled, sentences - 1) if n > target_tokens else max(scaled, sentences + 1))
    return long_document(index, max(best, 1), seed)
