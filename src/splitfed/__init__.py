"""splitfed: split learning, split federated learning and federated learning."""

__version__ = "0.1.0"
