"""Speculative decoding: proposers draft, the verifier accepts losslessly."""
