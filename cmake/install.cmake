# `cmake --install`: the public headers, libferry.so (SONAME libferry.so.X.Y),
# the C ABI (ferry.h over libferry_c.so), the ferry CLI, and a package config
# so another project can write
#   find_package(Ferry 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE Ferry::ferry)
include(CMakePackageConfigHelpers)

# What a user includes: all of src/include/ferry/ (the internal headers live
# next to their code in src/ and are not installed).
file(GLOB FERRY_PUBLIC_HEADERS "${PROJECT_SOURCE_DIR}/src/include/ferry/*.hpp"
     "${PROJECT_SOURCE_DIR}/src/include/ferry/ferry.h")
install(FILES ${FERRY_PUBLIC_HEADERS} DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/ferry")

install(TARGETS ferry ferry_cli EXPORT FerryTargets
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")

# The C ABI is linked by name (-lferry_c) from C and opened by ctypes: it
# carries its runtime inside and is not part of the CMake package.
install(TARGETS ferry_c LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}")
# `ferry demo --hosts` looks for it at <bin>/../share/ferry/hosts.sh.
install(PROGRAMS "${PROJECT_SOURCE_DIR}/tests/hosts/hosts.sh" DESTINATION "${CMAKE_INSTALL_DATADIR}/ferry")

set(FERRY_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/Ferry")
install(EXPORT FerryTargets NAMESPACE Ferry:: DESTINATION "${FERRY_CMAKE_DIR}")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/FerryConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/FerryConfig.cmake"
                              INSTALL_DESTINATION "${FERRY_CMAKE_DIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/FerryConfigVersion.cmake"
                                 COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/FerryConfig.cmake"
              "${PROJECT_BINARY_DIR}/FerryConfigVersion.cmake"
        DESTINATION "${FERRY_CMAKE_DIR}")
