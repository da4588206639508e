import pytest

from planlab.errors import GraphError
from planlab.graph import Signature


@pytest.mark.parametrize(
    "text, dims, reduce, frozen",
    [
        ("m k+, k+ n -> m n", ["m", "k", "n"], {"k"}, set()),
        ("b s h^, h^ -> b s h^", ["b", "s", "h"], set(), {"h"}),
        ("b s (n d) -> b s n d", ["b", "s", "n", "d"], set(), set()),
        ("n+ c^, n+ -> ", ["n", "c"], {"n"}, {"c"}),
        ("a 1 c, a b c -> a b c", ["a", "c", "b"], set(), set()),
        ("x y -> x", ["x", "y"], set(), {"y"}),  # a dimension dropped without '+' stays whole
    ],
)
def test_parse(text, dims, reduce, frozen):
    sig = Signature.parse(text)
    assert sig.dims() == dims
    assert set(sig.reduce) == reduce
    assert set(sig.frozen) == frozen
    assert Signature.parse(str(sig)) == sig


@pytest.mark.parametrize(
    "text, splittable, whole",
    [
        ("b s (n d) -> b s n d", ["b", "s", "n"], ["d"]),
        ("m k+, k+ n -> m n", ["m", "k", "n"], []),
        ("b h^ -> b h^", ["b"], ["h"]),
    ],
)
def test_splittable(text, splittable, whole):
    sig = Signature.parse(text)
    assert [d for d in sig.dims() if sig.splittable(d)] == splittable
    assert all(not sig.splittable(d) for d in whole)


@pytest.mark.parametrize("bad", ["m k, k n", "m k -> n -> m", "m 2x -> m", "m () -> m"])
def test_parse_errors(bad):
    with pytest.raises(GraphError):
        Signature.parse(bad)
