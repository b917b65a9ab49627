"""The stages of one request, each a plain function with one input and one output.

parse (`body`) → validate (`validate`) → view (`view`) → forward (`forward`); routing lives in
`edge.routing`, relaying and accounting in `edge.relay`, and `edge.app` runs them in order, timing
each one.
"""
