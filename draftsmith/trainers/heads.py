"""The head trainer: draft heads (Medusa, ...) against a frozen target."""


class HeadTrainer:
    needs_head = True
