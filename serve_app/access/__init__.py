"""Access control: who may do what, and what one tenant can learn of another."""
