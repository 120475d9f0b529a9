# The net plugin's layering rules, checked at build time (target r2ccl_layers) and by the
# unit test unit_layers (which also proves that a violation fails):
#   engine/            may include transport/path_io.h, never a transport, the API or the ABI
#   transport/tcp/     never transport/ib/ (and the reverse), the API, the ABI or the factory
#   transport/*.h/.cc  (the interface and runtime base) never a concrete transport; only
#                      transport/factory.cc knows both
#   api/               never a concrete transport (only transport/factory.h, transport.h)
#   sock/ netlink/ fault/ predict/  never the engine, a transport, the API or the ABI
# Usage: cmake -DROOT=<net_plugin dir> [-DSTAMP=<file to touch on success>] -P check_layers.cmake
# Exit status: 0 when every rule holds; otherwise a FATAL_ERROR naming file, line and rule.
if(NOT ROOT)
  message(FATAL_ERROR "check_layers.cmake: pass -DROOT=<net_plugin directory>")
endif()

set(violations "")
function(check_dir dir forbidden_regex rule)
  file(GLOB_RECURSE files "${ROOT}/${dir}*.cc" "${ROOT}/${dir}*.h")
  foreach(f ${files})
    file(RELATIVE_PATH rel "${ROOT}" "${f}")
    # Files of a subfolder are checked by that subfolder's own rule.
    if(dir STREQUAL "transport/" AND (rel MATCHES "^transport/(tcp|ib)/" OR rel STREQUAL "transport/factory.cc"))
      continue()
    endif()
    file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(l ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" inc "${l}")
      if(inc MATCHES "${forbidden_regex}")
        set(violations "${violations}\n  ${rel}: #include \"${inc}\": ${rule}" PARENT_SCOPE)
        set(violations "${violations}\n  ${rel}: #include \"${inc}\": ${rule}")
      endif()
    endforeach()
  endforeach()
endfunction()

check_dir("engine/" "^(transport/(tcp|ib|runtime_base|factory|transport)|api/|abi/|fault/|netlink/|sock/)"
          "the engine knows only transport/path_io.h")
check_dir("transport/tcp/" "^(transport/ib/|transport/factory|api/|abi/)"
          "a transport must not include the other transport, the factory, the API or the ABI")
check_dir("transport/ib/" "^(transport/tcp/|transport/factory|api/|abi/|fault/)"
          "a transport must not include the other transport, the factory, the API or the ABI")
check_dir("transport/" "^(transport/(tcp|ib)/|api/|abi/)"
          "the transport interface and runtime base must not include a concrete transport")
check_dir("api/" "^(transport/(tcp|ib)/|abi/)"
          "the API knows only the transport interface and the factory")
foreach(low sock/ netlink/ fault/ predict/)
  check_dir("${low}" "^(engine/|transport/|api/|abi/)"
            "${low} is below the engine and the transports")
endforeach()

if(violations)
  message(FATAL_ERROR "net plugin layering violated:${violations}")
endif()
if(STAMP)
  file(TOUCH "${STAMP}")
endif()
