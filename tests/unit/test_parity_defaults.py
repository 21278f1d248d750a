"""shoal parity's default tolerance exists for every number format a config can name (without one, `shoal parity`
of two fp8 configs crashed with a ValueError before it trained; the GPU tier found it)."""

import typing

from shoal.config.training import PrecisionConfig
from shoal.parity import DEFAULT_RTOL, PRECISION_ORDER


def test_every_number_format_has_a_default_tolerance_and_a_place_in_the_order():
    formats = set(typing.get_args(PrecisionConfig.model_fields["dtype"].annotation)) - {"auto"}
    assert set(DEFAULT_RTOL) == set(PRECISION_ORDER) == formats
    # the less precise format's tolerance is the looser: the order runs from the most precise
    assert [DEFAULT_RTOL[f] for f in PRECISION_ORDER] == sorted(DEFAULT_RTOL.values())
