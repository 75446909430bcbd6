"""What the fuzz tests draw for a field's value: scalars of every msgpack
type and small flat containers of them. Kept small and flat on purpose:
drawing deep values costs more than a round trip to the daemon, and the
decoder's limits are tested on their own."""

from hypothesis import strategies as st

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True), st.text(max_size=12), st.binary(max_size=24))
values = st.one_of(scalars, st.lists(scalars, max_size=3),
                   st.dictionaries(st.text(max_size=4), scalars, max_size=3))
