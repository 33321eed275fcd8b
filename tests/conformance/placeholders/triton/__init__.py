"""An empty `triton` for reading SGLang's argument parser on a machine without a GPU.

`sglang.srt.utils.common` imports triton (a GPU kernel compiler) at module level and, on import, only
sets one attribute on it; parsing a command line never compiles a kernel. The conformance tests put
this folder on the path of the subprocess that parses, and only when triton is not installed.
"""
