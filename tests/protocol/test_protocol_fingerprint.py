import pytest

from disagg.protocol import ErrorCode, Fingerprint, GroupGeometry, ProtocolError, check_compatible


def fp(**kw):
    base = dict(
        model="m",
        dtype="bf16",
        tokens_per_block=16,
        groups=[GroupGeometry(0, None, 4096, 2), GroupGeometry(1, 128, 2048, 1)],
        tp_size=2,
        tp_rank=0,
    )
    base.update(kw)
    return Fingerprint(**base)


def test_tp_is_not_compared_where_both_state_kv_heads():
    check_compatible(fp(num_kv_heads=8), fp(num_kv_heads=8, tp_size=4, tp_rank=3))
    for theirs, field in ((fp(num_kv_heads=4), "num_kv_heads"), (fp(model="x"), "model")):
        with pytest.raises(ProtocolError, match=f"peer's {field} is"):
            check_compatible(fp(num_kv_heads=8), theirs)
    with pytest.raises(ProtocolError, match="peer's num_kv_heads is 0 but ours is 8: both roles"):
        check_compatible(fp(num_kv_heads=8), fp())  # a head-blind peer: shards pair by rank


def test_equal_is_compatible():
    check_compatible(fp(), fp())
    check_compatible(
        fp(groups=[GroupGeometry(0, 0, 4096, 2), GroupGeometry(1, 128, 2048, 1)]), fp()
    )


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(model="other"), "model"),
        (dict(dtype="fp8"), "dtype"),
        (dict(tokens_per_block=32), "tokens_per_block"),
        (dict(tp_size=4), "tp_size"),
        (dict(tp_rank=1), "tp_rank"),
        (dict(groups=[GroupGeometry(0, None, 4096, 2)]), "number of layer groups"),
        (
            dict(groups=[GroupGeometry(0, None, 4096, 2), GroupGeometry(1, 256, 2048, 1)]),
            "groups[1].window",
        ),
        (
            dict(groups=[GroupGeometry(0, None, 8192, 2), GroupGeometry(1, 128, 2048, 1)]),
            "groups[0].bytes_per_page",
        ),
    ],
)
def test_mismatch_names_field(kw, field):
    with pytest.raises(ProtocolError) as ei:
        check_compatible(fp(), fp(**kw))
    assert ei.value.code == ErrorCode.INCOMPATIBLE_PEER
    assert f"peer's {field} is" in ei.value.message and "but ours is" in ei.value.message
