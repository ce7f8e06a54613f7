"""The reference forward pass over OUR checkpoint format: the numerical oracle for every later stage."""
