"""``two_tier``: a fraction of the clients are slow (compute and uplink)."""

from __future__ import annotations

import numpy as np

from splitfed import register_clock_profile
from splitfed.engine.profiles import CLIENT_COMPUTE, DOWNLINK, SERVER_COMPUTE, UPLINK, Profiles


@register_clock_profile("two_tier")
def two_tier(num_clients, rng, *, slow_fraction=0.5, slowdown=10.0):
    """Draws which clients are slow once, from the clock's own random stream."""
    if not (0 <= slow_fraction <= 1 and slowdown >= 1):
        raise ValueError("slow_fraction must be in [0, 1] and slowdown >= 1")
    slow = rng.random(num_clients) < slow_fraction
    factor = np.where(slow, 1.0 / slowdown, 1.0)
    return Profiles(CLIENT_COMPUTE * factor, UPLINK * factor,
                    np.full(num_clients, DOWNLINK), SERVER_COMPUTE)


two_tier.option_help = {
    "slow_fraction": "the chance that a client is slow, drawn once (0 <= slow_fraction <= 1)",
    "slowdown": "how many times slower a slow client computes and uploads (>= 1)",
}
