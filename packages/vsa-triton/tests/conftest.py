"""Kernel tests run compiled on a GPU; without one, under Triton's interpreter in a subprocess.

Triton chooses interpreted or compiled code when it is first imported (its own library helpers
are decorated then), so TRITON_INTERPRET=1 must be set before anything in the process imports
triton, torch.compile included. The CPU suite therefore runs the kernel tests in a child
process started with the variable set (test_interpreter.py); in the parent they are skipped.
"""
