"""The policy gateway: request rules, sandboxed WebAssembly policies and stream rules
(`gateway.PolicyGateway`), configured by the `[policy]` table (`config.PolicyConfig`)."""
