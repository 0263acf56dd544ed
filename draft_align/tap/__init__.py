"""The policy/target side: capture of aux hidden states and final hidden states (the Tap)."""
