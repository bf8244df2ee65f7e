"""Where the scale lives (host or device), the state dict, snapshot and counters.

``book`` holds the scale and trackers, ``format`` the versioned state-dict format, ``readings``
the scaler's counters, snapshot, state dict and pickled form; ``predictive`` and ``spike`` the
features' own parts of it.
"""
