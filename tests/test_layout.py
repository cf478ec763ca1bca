import numpy as np
import pytest
import torch

from linear_state import StateLayout


def test_qwen3_next_80b_slot_bytes_by_hand() -> None:
    layout = StateLayout.for_gdn(
        num_layers=36, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    conv_channels = 2 * 16 * 128 + 32 * 128  # q and k over k-heads, v over v-heads = 8192
    conv_per_layer = conv_channels * 3 * 2  # window of kernel-1 = 3 inputs, bf16 = 49,152
    recurrent_per_layer = 32 * 128 * 128 * 4  # one 128x128 fp32 matrix per v-head = 2,097,152
    assert layout.conv_shape == (8192, 3)
    assert layout.recurrent_shape == (32, 128, 128)
    assert layout.conv_dtype == torch.bfloat16 and layout.recurrent_dtype == torch.float32
    assert layout.slot_bytes == 36 * (conv_per_layer + recurrent_per_layer) == 77_266_944
    assert layout.state_shapes == ((36, 8192, 3), (36, 32, 128, 128))


def test_mamba2_layout() -> None:
    layout = StateLayout.for_mamba2(num_layers=2, num_heads=4, head_dim=8, state_size=16, n_groups=2)
    assert layout.conv_shape == (4 * 8 + 2 * 2 * 16, 3)
    assert layout.recurrent_shape == (4, 8, 16)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "conv_shape": (1, 1), "recurrent_shape": (1,)},
        {"num_layers": 1, "conv_shape": (), "recurrent_shape": (1,)},
        {"num_layers": 1, "conv_shape": (1, 0), "recurrent_shape": (1,)},
        {"num_layers": 1, "conv_shape": (1,), "recurrent_shape": (1,), "recurrent_dtype": torch.int32},
    ],
)
def test_bad_layouts_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StateLayout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": "2", "conv_shape": (1, 1), "recurrent_shape": (1,)}, "num_layers must be an int, got '2'"),
        ({"num_layers": True, "conv_shape": (1, 1), "recurrent_shape": (1,)}, "num_layers must be an int, got True"),
        ({"num_layers": 2, "conv_shape": (4.5, 3), "recurrent_shape": (1,)}, r"conv_shape must be a tuple of ints"),
        ({"num_layers": 2, "conv_shape": (4, 3), "recurrent_shape": 16}, r"recurrent_shape must be a tuple of ints"),
        ({"num_layers": 2, "conv_shape": (4, 3), "recurrent_shape": (1,), "conv_dtype": "bfloat16"}, "torch.dtype"),
        ({"num_layers": 2, "conv_shape": (4, 3), "recurrent_shape": (1,), "model_layers": (0, 1.5)}, "model_layers"),
    ],
)
def test_layouts_of_the_wrong_types_raise_type_errors_naming_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        StateLayout(**kwargs)  # type: ignore[arg-type]


def test_numpy_ints_make_the_same_layout_as_python_ints() -> None:
    a = StateLayout(np.int64(2), (np.int32(4), 3), (2, 4, 4))  # type: ignore[arg-type]
    b = StateLayout(2, (4, 3), (2, 4, 4))
    assert a == b and repr(a) == repr(b) and type(a.num_layers) is int


def test_gdn_kernel_must_keep_a_window() -> None:
    with pytest.raises(ValueError, match="conv_kernel"):
        StateLayout.for_gdn(1, 1, 1, 1, 1, conv_kernel=1)


def test_layout_is_frozen() -> None:
    layout = StateLayout(1, (2, 3), (4,))
    with pytest.raises(AttributeError):
        layout.num_layers = 2  # type: ignore[misc]
