"""Driving the scheduler without a model (test_scheduler.py, test_fairness.py)."""


def advance(sched, batch, token=7):
    """Pretend the forward ran: mark tokens computed and append a token where the chunk reached the end."""
    for r, n in zip(batch.requests, batch.num_new_tokens):
        r.num_computed_tokens += n
        sched.blocks.cache_full_blocks(r)
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(token)
