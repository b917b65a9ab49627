;; Example policy module (ABI in docs/policy.md): refuses a request whose view contains the
;; keyword "forbidden", in any ASCII letter case; allows every other request.
;;
;; Build: python -m edge.policy.examples.build  (wasmtime.wat2wasm), or `wat2wasm` from wabt.
(module
  (memory (export "memory") 1)
  ;; answers, at fixed addresses below the input buffer
  (data (i32.const 0) "{\"action\":\"allow\"}")                         ;; 18 bytes
  (data (i32.const 64) "{\"action\":\"deny\",\"reason\":\"keyword\"}")    ;; 36 bytes
  (data (i32.const 128) "forbidden")                                    ;; 9 bytes
  (global $input i32 (i32.const 1024))

  ;; One input buffer at 1024, grown to fit; the host reuses it for later inputs that fit.
  (func (export "alloc") (param $len i32) (result i32)
    (local $need i32)
    (local.set $need
      (i32.shr_u (i32.add (i32.add (global.get $input) (local.get $len)) (i32.const 65535))
                 (i32.const 16)))
    (if (i32.gt_u (local.get $need) (memory.size))
      (then
        (if (i32.eq (memory.grow (i32.sub (local.get $need) (memory.size))) (i32.const -1))
          (then unreachable))))
    (global.get $input))

  ;; 1 when the 9 bytes at $p equal "forbidden" (ASCII letters folded to lower case)
  (func $at (param $p i32) (result i32)
    (local $i i32)
    (block $no
      (loop $next
        (br_if $no
          (i32.ne (i32.or (i32.load8_u (i32.add (local.get $p) (local.get $i))) (i32.const 32))
                  (i32.load8_u (i32.add (i32.const 128) (local.get $i)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $next (i32.lt_u (local.get $i) (i32.const 9))))
      (return (i32.const 1)))
    (i32.const 0))

  (func (export "check") (param $ptr i32) (param $len i32) (result i64)
    (local $p i32) (local $end i32)
    (local.set $p (local.get $ptr))
    (local.set $end (i32.sub (i32.add (local.get $ptr) (local.get $len)) (i32.const 8)))
    (block $done
      (loop $scan
        (br_if $done (i32.ge_s (local.get $p) (local.get $end)))
        ;; the first letter alone first: most bytes go no further
        (if (i32.eq (i32.or (i32.load8_u (local.get $p)) (i32.const 32)) (i32.const 102))
          (then
            (if (call $at (local.get $p))
              (then (return (i64.or (i64.shl (i64.const 64) (i64.const 32)) (i64.const 36)))))))
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (br $scan)))
    (i64.const 18)))
