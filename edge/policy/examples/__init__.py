"""Example policy modules: WebAssembly text sources and their prebuilt `.wasm` copies."""
