# Writes OUT, a C++ file defining quantd::store::BuiltinMigrations() from the *.sql files in DIR
# (named NNNN_name.sql), in file-name order. Run as: cmake -DDIR=... -DOUT=... -P this-file.
file(GLOB files "${DIR}/*.sql")
list(SORT files)
set(body "")
foreach(f ${files})
  get_filename_component(name ${f} NAME)
  string(REGEX MATCH "^([0-9]+)_" _ ${name})
  if(NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "migration ${name} is not named NNNN_name.sql")
  endif()
  math(EXPR version "${CMAKE_MATCH_1}")
  file(READ ${f} sql)
  string(APPEND body "      {${version}, \"${name}\", R\"quantd_sql(${sql})quantd_sql\"},\n")
endforeach()
file(WRITE ${OUT}.new "// Generated from migrations/*.sql by server/store/embed_migrations.cmake.
#include \"server/store/migrations.h\"

namespace quantd::store {

const std::vector<Migration>& BuiltinMigrations() {
  static const std::vector<Migration> kMigrations = {
${body}  };
  return kMigrations;
}

}  // namespace quantd::store
")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.new ${OUT})
file(REMOVE ${OUT}.new)
