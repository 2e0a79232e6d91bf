define internal void @static_helper(ptr %a) {
  ret void
}
define dso_local void @"quoted name"(ptr noalias noundef align 32 %0, i32 noundef %1) #0 {
  ret void
}
define void @byval_struct(ptr noundef byval({ i32, i32 }) align 8 %0) {
  ret void
}
define void @vec(<4 x float> %v, { float, [2 x i32] } %s) {
  ret void
}
define void @varargs(ptr %a, ...) {
  ret void
}
