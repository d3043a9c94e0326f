"""metrics.Histogram: the vectorised observe_many counts exactly as observe() one by one."""

from hypothesis import given, settings
from hypothesis import strategies as st

from metrics import ITL_BUCKETS, Histogram

# Values on and around the bucket bounds (Prometheus' `le`: a value equal to a bound
# belongs to that bucket), far outside them, and anything in between.
values = st.one_of(st.sampled_from([*ITL_BUCKETS, 0.0, 1e9]),
                   st.floats(min_value=0.0, max_value=200.0, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(values, max_size=300))
def test_observe_many_equals_observe_one_by_one(vals):
    one, many = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for v in vals:
        one.observe(v)
    many.observe_many(vals)
    assert many.counts == one.counts and many.count == one.count
    assert abs(many.sum - one.sum) <= 1e-9 * max(1.0, abs(one.sum))
