"""Model code (Llama family), configuration and weight loading."""
