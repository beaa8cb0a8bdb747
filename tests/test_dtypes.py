"""dtypes.to_dtype: both vocabularies, the allowed set, and an option's own words (auto, keep)."""

from __future__ import annotations

import pytest
import torch

from eyas.dtypes import MODEL_DTYPES, to_dtype
from eyas.errors import EyasError


def test_an_options_own_words_are_accepted_as_none_and_listed_in_the_error():
    assert to_dtype("bf16", allowed=MODEL_DTYPES, also=("auto",)) is torch.bfloat16
    assert to_dtype("bfloat16") is torch.bfloat16
    assert to_dtype("auto", what="--model-dtype", allowed=MODEL_DTYPES, also=("auto",)) is None
    assert to_dtype("keep", what="--weights-dtype", allowed=MODEL_DTYPES, also=("keep",)) is None
    with pytest.raises(EyasError, match=r"^--weights-dtype auto: not a dtype eyas knows; it takes keep, fp32, bf16"):
        to_dtype("auto", what="--weights-dtype", allowed=MODEL_DTYPES, also=("keep",))  # another option's word
    with pytest.raises(EyasError, match=r"^--model-dtype fp8: fp8 is not supported here; it takes auto, fp32"):
        to_dtype("fp8", what="--model-dtype", allowed=MODEL_DTYPES, also=("auto",))
    with pytest.raises(EyasError, match="not a dtype eyas knows"):
        to_dtype("auto")  # no words: a dtype only
